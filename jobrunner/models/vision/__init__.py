"""Vision encoders and the vision-language models built on our decoders (SmolVLM / Idefics3: ``idefics3.py``)."""
