"""Built-in passes: one module per pass, named after it (insert_qdq.py <-> insert-qdq)."""
