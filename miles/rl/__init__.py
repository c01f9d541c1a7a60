"""The RL job (`miles rl`): loop.py the loop, schedule.py when each rollout is generated and on
which weights, rollout.py generation -> rewards -> dynamic sampling, train.py samples and
updates, evaluate.py held-out accuracy, engines.py starting the engines and syncing their
weights. The decisions themselves (advantages, losses, rewards, filters) are in miles.algo."""
