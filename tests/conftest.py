import os

os.environ.setdefault("QPASSES_NO_PROGRESS", "1")
