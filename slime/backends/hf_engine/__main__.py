"""`python -m slime.backends.hf_engine --model-path DIR --port N`: start the hf engine server."""

from slime.backends.hf_engine.server import main

if __name__ == "__main__":
    main()
