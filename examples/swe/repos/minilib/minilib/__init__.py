"""minilib: a tiny utility library, the repository of reins' shipped SWE task set."""
