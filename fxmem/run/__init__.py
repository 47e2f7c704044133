"""Running a plan: the engine behind `fxmem.optimize`, PyTorch's own eager step where it serves better,
the joint graphs kept in this process; `run.inductor` and `run.dynamo` compile the planned step."""
