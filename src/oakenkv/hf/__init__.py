"""The transformers adapter: ``OakenCache``, the packed attention function, version compatibility."""
