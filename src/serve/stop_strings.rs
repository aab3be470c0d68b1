//! Stop strings over streamed text: text that may be the start of a stop string is held
//! back until it is known not to be one, so a client never sees part of a stop string.

/// Watches streamed text for any of a set of stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
    hit: Option<String>,
}

impl StopStrings {
    /// A watcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
            hit: None,
        }
    }

    /// Whether a stop string was seen.
    pub fn hit(&self) -> bool {
        self.hit.is_some()
    }

    /// The stop string that was seen.
    pub fn matched(&self) -> Option<&str> {
        self.hit.as_deref()
    }

    /// Adds text; returns what may be shown now. After a hit, returns the text before the
    /// stop string and nothing ever after.
    pub fn push(&mut self, text: &str) -> String {
        if self.hit.is_some() {
            return String::new();
        }
        if self.stops.is_empty() {
            return text.to_string();
        }
        self.held.push_str(text);
        let first = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, _)| *at);
        if let Some((at, s)) = first {
            self.hit = Some(s.clone());
            let out = self.held[..at].to_string();
            self.held.clear();
            return out;
        }
        // Hold the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let out = self.held[..cut].to_string();
        self.held.drain(..cut);
        out
    }

    /// The text still held back, at the end of the stream.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_back_a_possible_stop_and_cuts_at_a_real_one() {
        let mut s = StopStrings::new(&["END".to_string(), "xy".to_string()]);
        assert_eq!(s.push("abc E"), "abc ");
        assert_eq!(s.push("N"), "");
        assert_eq!(s.push("Dafter"), "");
        assert_eq!(s.matched(), Some("END"));
        assert_eq!(s.push("more"), "");
        let mut s = StopStrings::new(&["END".to_string()]);
        assert_eq!(s.push("EN"), "");
        assert_eq!(s.push("o"), "ENo");
        assert_eq!(s.push("E"), "");
        assert_eq!(s.finish(), "E");
        assert!(!s.hit());
        let mut s = StopStrings::new(&["é!".to_string()]);
        assert_eq!(s.push("café"), "caf");
        assert_eq!(s.push("!x"), "");
        assert!(s.hit());
    }
}
