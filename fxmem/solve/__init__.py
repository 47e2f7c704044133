"""The torch-free solvers, one subpackage or module per problem. Each reads plain integers and lists
(no torch, no fx, no files) and returns plain data:

  recompute/   keep / recompute / offload each value saved for backward (`fxmem.solve.problem.MemoryProblem`
               -> `fxmem.solve.solution.Solution`): greedy, CP-SAT, exact, layered, brute force
  packing/     offsets of buffers with known lifetimes in one arena (`pack_buffers` -> `Packing`)
  stages.py    contiguous pipeline stages under a per-stage memory budget (`StageProblem` -> `StagePlan`)
  placement.py contiguous regions of a model on several devices (`place_regions` -> `Placement`)
  partition.py the contiguous-partition dynamic programme that stages and placement share
  effort.py    the searches' limits, counted work rather than seconds, so every run gives the same answer
               (stages, placement and partition are dynamic programmes: no limit)
"""
