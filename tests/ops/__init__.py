"""Operations: start-up refusals, degraded tiers, metrics and logs, S3 options, deployments."""
