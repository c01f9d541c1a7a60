"""miles: post-training for DeepSeek-V4-architecture models."""

import warnings

# Megatron-core warns on import, in every process, that Transformer Engine and Apex are not
# installed; miles uses neither (its own kernels), so the four lines are only noise in a job's log.
warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed", category=UserWarning)
