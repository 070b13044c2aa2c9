"""Integrations of the Oaken KV cache into serving engines (``oakenkv.integrations.vllm``).

Nothing is imported here: an integration imports its engine only when it is used.
"""
