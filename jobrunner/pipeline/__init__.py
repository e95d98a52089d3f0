"""Pipelines (`stages:` in a job spec): the pure parts — filter expressions, prompt templates, the columns a stage
hands on. No storage, no Ray: io/stage_input.py writes what these compute, driver/pipeline.py runs the stages."""
