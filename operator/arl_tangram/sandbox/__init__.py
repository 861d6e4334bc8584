"""The sandbox agent: runs untrusted code per action with exclusive cores, limits and sessions."""
