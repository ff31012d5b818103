"""Gateway routes, one module per resource."""
