"""Checkpoints: policy.py when to save and what to keep (pure), store.py the save directory
(atomic commits, recovery, ckpt.load), sharded.py a rank's state as resharding tensors,
manager.py the loop's side (restore, save, async commits), convert.py `miles convert`,
safe_metadata.py torch DCP metadata read through an allow-list."""
