"""The data layer: tasks (procedural, dataset and the controlled tasks of bench), a user's own data
(datasource), graders (grading), reward functions in their worker process (rewards) and TRL's metric
names (reward_metrics). The package folder also holds the bundled fidelity reference sets (*.pt).
It imports the credit and engine layers, never train, analysis or integrations.
"""
