import os

import pytest

os.environ.setdefault("QPASSES_NO_PROGRESS", "1")
pytest.register_assert_rewrite("tests.kits")   # the kits' asserts say what they compared, as tests' do
