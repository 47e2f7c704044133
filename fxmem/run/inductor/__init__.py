"""Inductor compiles fxmem's plan, and its code is read to price what the plan holds and takes."""
