# Helpers live in dist_helpers.py (tests import them by that name: every conftest.py is a
# module called "conftest", so importing helpers from one is ambiguous across directories).
from dist_helpers import one_process_runs, tiny_llama  # noqa: F401  (session fixtures)
