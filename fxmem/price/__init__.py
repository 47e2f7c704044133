"""Cost: per node of a captured step, bytes kept for backward, FLOPs and seconds (by formula, by timer,
or as Inductor compiles it); the joint graph turned into the torch-free memory problem."""
