"""Code generated from proto/ by proto/generate.py. Never edit by hand."""
