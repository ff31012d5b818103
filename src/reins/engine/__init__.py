"""The embedded inference engine and the helpers that prepare the models it serves."""
