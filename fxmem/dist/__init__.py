"""Several devices: pipeline stages, device regions and placement, and the parts of an FSDP2 rank."""
