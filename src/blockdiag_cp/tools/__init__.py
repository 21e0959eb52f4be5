"""What a person runs, not what a training script imports: ``blockdiag-cp demo | bench | verify | plan``."""
