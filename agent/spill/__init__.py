"""The spill: a durable local spool of what the fog produced and the shipper that moves it to the centre."""
