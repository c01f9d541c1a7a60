"""miles: post-training for DeepSeek-V4-architecture models."""
