"""What several test files share: graphs, model builders, CPU probes, the fuzz generators."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository: README.md, docs/, tools/, qpasses/
