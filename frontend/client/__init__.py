"""The client library: Client, AsyncClient and the engine a client may own."""
