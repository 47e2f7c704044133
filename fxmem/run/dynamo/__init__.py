"""A step Dynamo splits into several graphs, planned under one budget; the machinery the engine and the
`torch.compile` backend share."""
