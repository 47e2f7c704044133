"""`fxmem-plan`: plan a model offline and print, save or draw the plan."""
