"""tablelib: unit conversion by table, the second repository of reins' shipped SWE task set."""
