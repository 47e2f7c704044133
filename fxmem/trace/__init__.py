"""Capture: a model and its inputs as a torch.fx graph on fake tensors; where the loss is, call checks,
the meta device, autocast, and what torch prints meanwhile."""
