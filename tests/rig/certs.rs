//! Certificates made in the test (the `openssl` crate outboxd already links): a private CA, server
//! certificates with chosen names and validity, client certificates, each written as PEM files.

use std::path::{Path, PathBuf};

use openssl::asn1::Asn1Time;
use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{
    BasicConstraints, ExtendedKeyUsage, KeyUsage, SubjectAlternativeName,
};
use openssl::x509::{X509NameBuilder, X509};

/// A certificate authority that signs what the test needs.
pub struct Ca {
    key: PKey<Private>,
    cert: X509,
    /// The CA certificate as PEM on disk.
    pub pem: PathBuf,
}

/// A certificate and its key on disk.
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// How long from now a certificate is valid, in days (negative: in the past).
pub struct Validity {
    pub from_days: i64,
    pub to_days: i64,
}

pub const VALID: Validity = Validity {
    from_days: -1,
    to_days: 30,
};
pub const EXPIRED: Validity = Validity {
    from_days: -30,
    to_days: -1,
};

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap()
}

fn time(days: i64) -> Asn1Time {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    Asn1Time::from_unix(now + days * 86_400).unwrap()
}

fn name(common_name: &str) -> openssl::x509::X509Name {
    let mut b = X509NameBuilder::new().unwrap();
    b.append_entry_by_nid(Nid::COMMONNAME, common_name).unwrap();
    b.build()
}

fn serial() -> openssl::asn1::Asn1Integer {
    let mut bn = BigNum::new().unwrap();
    bn.rand(64, openssl::bn::MsbOption::MAYBE_ZERO, false)
        .unwrap();
    bn.to_asn1_integer().unwrap()
}

impl Ca {
    /// A new self-signed CA named `common_name`, its PEM written to `dir/<file>.pem`.
    pub fn new(dir: &Path, common_name: &str, file: &str) -> Ca {
        let key = key();
        let mut b = X509::builder().unwrap();
        b.set_version(2).unwrap();
        b.set_serial_number(&serial()).unwrap();
        b.set_subject_name(&name(common_name)).unwrap();
        b.set_issuer_name(&name(common_name)).unwrap();
        b.set_pubkey(&key).unwrap();
        b.set_not_before(&time(-1)).unwrap();
        b.set_not_after(&time(365)).unwrap();
        b.append_extension(BasicConstraints::new().critical().ca().build().unwrap())
            .unwrap();
        b.append_extension(
            KeyUsage::new()
                .critical()
                .key_cert_sign()
                .crl_sign()
                .build()
                .unwrap(),
        )
        .unwrap();
        b.sign(&key, MessageDigest::sha256()).unwrap();
        let cert = b.build();
        let pem = dir.join(format!("{file}.pem"));
        std::fs::write(&pem, cert.to_pem().unwrap()).unwrap();
        Ca { key, cert, pem }
    }

    /// A server certificate for `names` (DNS names, or IP addresses when they parse as one).
    pub fn server(&self, dir: &Path, file: &str, names: &[&str], validity: Validity) -> Issued {
        self.issue(dir, file, names[0], names, validity, false)
    }

    /// A client certificate whose common name is `user`.
    pub fn client(&self, dir: &Path, file: &str, user: &str) -> Issued {
        self.issue(dir, file, user, &[], VALID, true)
    }

    fn issue(
        &self,
        dir: &Path,
        file: &str,
        common_name: &str,
        names: &[&str],
        validity: Validity,
        client: bool,
    ) -> Issued {
        let key = key();
        let mut b = X509::builder().unwrap();
        b.set_version(2).unwrap();
        b.set_serial_number(&serial()).unwrap();
        b.set_subject_name(&name(common_name)).unwrap();
        b.set_issuer_name(self.cert.subject_name()).unwrap();
        b.set_pubkey(&key).unwrap();
        b.set_not_before(&time(validity.from_days)).unwrap();
        b.set_not_after(&time(validity.to_days)).unwrap();
        if !names.is_empty() {
            let mut san = SubjectAlternativeName::new();
            for n in names {
                if n.parse::<std::net::IpAddr>().is_ok() {
                    san.ip(n);
                } else {
                    san.dns(n);
                }
            }
            let ext = san
                .build(&b.x509v3_context(Some(&self.cert), None))
                .unwrap();
            b.append_extension(ext).unwrap();
        }
        let usage = if client {
            ExtendedKeyUsage::new().client_auth().build().unwrap()
        } else {
            ExtendedKeyUsage::new().server_auth().build().unwrap()
        };
        b.append_extension(usage).unwrap();
        b.sign(&self.key, MessageDigest::sha256()).unwrap();
        let cert = b.build();
        let cert_path = dir.join(format!("{file}.pem"));
        let key_path = dir.join(format!("{file}.key"));
        std::fs::write(&cert_path, cert.to_pem().unwrap()).unwrap();
        std::fs::write(&key_path, key.private_key_to_pem_pkcs8().unwrap()).unwrap();
        Issued {
            cert: cert_path,
            key: key_path,
        }
    }
}
