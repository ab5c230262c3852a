"""Security properties: default deny on the network, key file modes, certificates, secrets in logs."""
