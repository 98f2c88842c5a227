"""The torch reference's tests need no Keras backend: they run once, in the
torch pass of the test command."""

import os

collect_ignore = [] if os.environ.get("KERAS_BACKEND", "torch") == "torch" else ["test_torch_reference.py"]
