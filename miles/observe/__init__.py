"""Observation: metrics.py the monitor (metrics.jsonl, wandb, the console), records.py the run
directory's record files, alignment.py per-step checksums to compare runs, busy.py the
engines' busy spans, profiler.py torch.profiler traces, report.py `miles report`'s plots."""
