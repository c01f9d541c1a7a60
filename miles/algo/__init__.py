"""RL algorithms as small pure functions: advantages, policy losses, rewards, dynamic sampling."""
