"""Plans: a joint graph, priced, solved and cut into forward and backward graphs (the AOTAutograd
partition function); the Plan, its table, named policies and the chunk choices."""
