"""SFT, PPO and GRPO trainers, algorithms, data, rewards and the posttrain CLI."""
