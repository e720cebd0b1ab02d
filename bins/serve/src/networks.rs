//! Address ranges (`10.0.0.0/8`, `fd00::/8`, `127.0.0.1`) that worker URLs and event endpoints
//! may point into: with a list configured, a worker added through the API cannot point the
//! gateway at an address outside the fleet's network (and so receive other clients' prompts
//! on a machine of the caller's choosing).

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address range: an address and the length of its prefix in bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Network {
    addr: IpAddr,
    prefix: u8,
}

/// A range that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not an address range (ADDRESS or ADDRESS/PREFIX)")]
pub struct BadNetwork(String);

impl FromStr for Network {
    type Err = BadNetwork;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadNetwork(s.to_owned());
        let (addr, prefix) = match s.split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s, None),
        };
        let addr: IpAddr = addr.trim().parse().map_err(|_| bad())?;
        let bits = if addr.is_ipv4() { 32 } else { 128 };
        let prefix = match prefix {
            Some(p) => p.trim().parse::<u8>().map_err(|_| bad())?,
            None => bits,
        };
        if prefix > bits {
            return Err(bad());
        }
        Ok(Network { addr, prefix })
    }
}

impl fmt::Display for Network {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

impl serde::Serialize for Network {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Network {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

impl Network {
    /// Whether `ip` lies in the range (an IPv4-mapped IPv6 address counts as its IPv4 one).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_parse_and_hold_what_they_should() {
        let net: Network = "10.1.0.0/16".parse().unwrap();
        assert!(net.contains("10.1.200.3".parse().unwrap()));
        assert!(!net.contains("10.2.0.1".parse().unwrap()));
        assert!(!net.contains("::1".parse().unwrap()));
        let one: Network = "127.0.0.1".parse().unwrap();
        assert!(one.contains("127.0.0.1".parse().unwrap()));
        assert!(one.contains("::ffff:127.0.0.1".parse().unwrap()));
        assert!(!one.contains("127.0.0.2".parse().unwrap()));
        let all: Network = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains("8.8.8.8".parse().unwrap()));
        let v6: Network = "fd00::/8".parse().unwrap();
        assert!(v6.contains("fd12::1".parse().unwrap()));
        assert!(!v6.contains("fe80::1".parse().unwrap()));
        for bad in ["10.0.0.0/33", "example.com", "10.0.0.0/x", "::/129", ""] {
            assert!(bad.parse::<Network>().is_err(), "{bad}");
        }
    }
}
