"""branchbox: fork / explore / commit runtime for AI agents."""
