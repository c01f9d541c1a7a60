"""Data: dataset.py rows from JSONL / Parquet files (each with its file and row), chat.py
conversations -> token ids and loss masks (DeepSeek-V4's encoding, or an HF template), sft.py
the SFT source (bad rows, shuffle, epochs, the held-out split), prompts.py the RL prompt
source, synthetic.py the bundled synthetic source, sample.py the sample every source yields,
bundled/ the tiny data and tokenizer."""
