"""Model plugins: one folder per model family (deepseek_v4)."""
