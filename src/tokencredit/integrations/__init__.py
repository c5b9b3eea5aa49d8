"""Integrations of tokencredit's credit methods into other trainers (``tokencredit.integrations.trl``)."""
