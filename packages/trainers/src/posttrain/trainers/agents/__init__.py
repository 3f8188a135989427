"""Multi-turn agentic RL: tool-call parsers, token-in-token-out trajectories and the agent loop."""
