"""Building blocks: attention core, position indices/tables, position terms."""
