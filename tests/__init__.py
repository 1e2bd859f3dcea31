"""qpasses' tests, a package: tests/<layer>/ mirrors qpasses/<layer>/, tests/integration/ runs whole
pipelines and commands, tests/project/ checks the repository (docs, layering, hygiene), and
tests/kits/ holds what several test files share (``from tests.kits import report_kit``)."""
