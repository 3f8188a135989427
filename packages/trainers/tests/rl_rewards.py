"""A dense reward for RL tests: the share of digits in the response, so a random tiny model gets a signal."""


def digit_share(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
