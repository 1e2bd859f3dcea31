"""The pass framework: Pass and the pass manager, pipeline text, the registry, RunContext, facts and
their checks, instruments (timing, verify-each, dumps, reproducer, up-front refusals) and progress."""
