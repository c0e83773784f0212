"""`python -m nanoserve.serving [MODEL] [flags]`: the same as `nanoserve serve`."""
from nanoserve.serving.cli import serve_main

serve_main()
