"""Provider audit over HTTP: is this OpenAI-compatible endpoint serving the model it claims?

The audit sends prompts (greedy spot checks, or seeded sampling when the provider's sampler is
known), persists every raw response before scoring it (``store``), turns responses into claimed
token ids while measuring tokenization drift (``responses``), scores them against a trusted
reference (``reference``: a local model through the project's verifier, or a reference API that
echoes prompt logprobs), compares the pooled score with calibrated bands (``bands``, ``verdict``)
and writes JSON and self-contained HTML reports (``report``). ``run`` ties the steps together;
``cli`` is ``verinfer audit``.
"""
