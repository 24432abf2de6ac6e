"""The run's settings: each setting's default, help and checks, with the learning-rate defaults per preset (`config`),
the flags made from them and the look-ups of names (`cli`), XLA flag sets (`flags`), and the settings resolved once
into a `Job` with the device's memory budget (`job`)."""
