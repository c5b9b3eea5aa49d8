"""The train layer: the own trainer and everything a run is made of: the typed config (config,
config_fields, config_sections), a step's rollouts and rewards (collect, DAPO's pieces in dapo), the
update, evaluation, the saved-rollouts record (records), checkpoints, the run folder and run control,
export, and the trainer itself. It imports the layers below, never analysis or integrations.
"""
