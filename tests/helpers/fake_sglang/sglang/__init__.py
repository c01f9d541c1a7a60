"""A stand-in for SGLang's package in tests: `python -m sglang.launch_server` starts and never
answers (a server still loading a large model's weights)."""
