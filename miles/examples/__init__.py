"""Example user code the bundled jobs name (tools, for `rollout.tools`)."""
