"""The verl reward of the end-to-end tests (``reward.custom_reward_function``): 1.0 when the
response contains a character of the ground truth, else 0.0. A random tiny model's responses
then score 0 or 1 at rates that vary within a prompt's group, so group advantages are not zero."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 1.0 if any(c in solution_str for c in str(ground_truth)) else 0.0
