"""Learner/rollout alignment: strict mode, diagnostics, mismatch metrics."""
